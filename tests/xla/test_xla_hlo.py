"""Snapshots of the HLO a small scan on XLA tensors produces: the graph torch_xla
builds for a scan's outputs, with the While module of csrc/hlo_scan.cc called
from its entry. To update after an intended change, run with EXPECTTEST_ACCEPT=1
and read the diff.

The text is normalized so that it reads as HLO and stays put: instruction ids
are renumbered in order of first appearance (names keep their kind: %while.N,
%get-tuple-element.N, %p0.N), layouts, metadata and operand types are dropped;
result shapes, parameter numbers and tuple indices stay.
"""
import re

import expecttest
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")

from torch_scan_hop import scan  # noqa: E402

DEV = torch_xla.device()

_NAME_ID = re.compile(r"(?<![\w.-])([A-Za-z_][\w-]*)\.(\d+)\b")
_METADATA = re.compile(r',\s*metadata=\{(?:"(?:[^"\\]|\\.)*"|[^{}"])*\}')
_LAYOUT = re.compile(r"(?<=\])\{[^{}]*\}")  # f32[2,3]{1,0} -> f32[2,3]
_OPERAND_TYPE = re.compile(r"(?:\w+\[[\d,]*\]|\([^()]*\)) (?=%)")  # add(f32[] %a, ...) -> add(%a, ...)


def normalized_hlo(text):
    lines = [line for line in text.strip().splitlines() if not line.startswith("HloModule ")]
    text = "\n".join(lines).strip()
    text = _METADATA.sub("", text)
    text = _LAYOUT.sub("", text)
    text = _OPERAND_TYPE.sub("", text)
    ids = {}

    def renumber(m):
        name = m.group(0)
        if name not in ids:
            ids[name] = f"{m.group(1)}.{len(ids) + 1}"
        return ids[name]

    text = _NAME_ID.sub(renumber, text)
    return "\n".join(line.rstrip() for line in text.splitlines())


def rnn_scan_hlo(reverse, unroll=1):
    """A 2-step RNN over a batch of 4 with hidden size 3, W a closure: the HLO of (final carry, ys)."""
    w = torch.randn(3, 3).to(DEV)

    def cell(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)

    c, ys = scan(cell, torch.zeros(4, 3).to(DEV), torch.randn(2, 4, 3).to(DEV), reverse=reverse, unroll=unroll)
    return normalized_hlo(torch_xla._XLAC._get_xla_tensors_hlo([c, ys]))


def test_normalized_hlo_renumbers_ids_and_drops_layouts_metadata_and_operand_types():
    text = """HloModule IrToHlo.9, entry_computation_layout={(f32[2]{0})->f32[2]{0}}

ENTRY %IrToHlo.9 (p0.7: f32[2]) -> f32[2] {
  %p0.7 = f32[2]{0} parameter(0), metadata={op_type="xla__device_data" op_name="a.1/b{c}" source_line=3}
  ROOT %tanh.8 = f32[2]{0} tanh(f32[2]{0} %p0.7), metadata={op_type="aten__tanh"}
}"""
    assert normalized_hlo(text) == """ENTRY %IrToHlo.1 (p0.2: f32[2]) -> f32[2] {
  %p0.2 = f32[2] parameter(0)
  ROOT %tanh.3 = f32[2] tanh(%p0.2)
}"""


class TestScanHlo(expecttest.TestCase):
    def test_rnn_forward(self):
        self.assertExpectedInline(rnn_scan_hlo(reverse=False), """\
%AddComputation.1 (x.2: f32[], y.3: f32[]) -> f32[] {
  %x.2 = f32[] parameter(0)
  %y.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(%x.2, %y.3)
}

%scan_body.5 (p0.6: f32[4,3], p1.7: f32[3,3], p2.8: f32[4,3]) -> (f32[4,3], f32[4]) {
  %constant.9 = s32[] constant(3)
  %p2.8 = f32[4,3] parameter(2)
  %p1.7 = f32[3,3] parameter(1)
  %dot.10 = f32[4,3] dot(%p2.8, %p1.7), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %p0.6 = f32[4,3] parameter(0)
  %constant.11 = f32[] constant(1)
  %broadcast.12 = f32[4,3] broadcast(%constant.11), dimensions={}
  %multiply.13 = f32[4,3] multiply(%p0.6, %broadcast.12)
  %add.14 = f32[4,3] add(%dot.10, %multiply.13)
  %tanh.15 = f32[4,3] tanh(%add.14)
  %constant.16 = f32[] constant(0)
  %reduce.17 = f32[4] reduce(%tanh.15, %constant.16), dimensions={1}, to_apply=%AddComputation.1
  ROOT %tuple.18 = (f32[4,3], f32[4]) tuple(%tanh.15, %reduce.17)
}

%scan_loop0.19 (state.20: (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[])) -> (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) {
  %state.20 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) parameter(0)
  %counter.21 = s64[] get-tuple-element(%state.20), index=0
  %unroll.22 = s64[] constant(1)
  %next_counter.23 = s64[] add(%counter.21, %unroll.22)
  %xs0.24 = f32[2,4,3] get-tuple-element(%state.20), index=2
  %s0_start.25 = s64[] constant(0)
  %s0_idx.26 = s64[] add(%s0_start.25, %counter.21)
  %s0_zero.27 = s64[] constant(0)
  %s0_x0_row.28 = f32[1,4,3] dynamic-slice(%xs0.24, %s0_idx.26, %s0_zero.27, %s0_zero.27), dynamic_slice_sizes={1,4,3}
  %s0_x0.29 = f32[4,3] reshape(%s0_x0_row.28)
  %pass0.30 = f32[3,3] get-tuple-element(%state.20), index=4
  %carry0.31 = f32[4,3] get-tuple-element(%state.20), index=1
  %s0_body.32 = (f32[4,3], f32[4]) call(%s0_x0.29, %pass0.30, %carry0.31), to_apply=%scan_body.5
  %s0_carry0.33 = f32[4,3] get-tuple-element(%s0_body.32), index=0
  %ys0.34 = f32[2,4] get-tuple-element(%state.20), index=3
  %block0.35 = f32[1,4] get-tuple-element(%state.20), index=5
  %offset0.36 = s64[] get-tuple-element(%state.20), index=6
  %pending_zero0.37 = s64[] constant(0)
  %pending_ys0.38 = f32[2,4] dynamic-update-slice(%ys0.34, %block0.35, %offset0.36, %pending_zero0.37)
  %s0_y0.39 = f32[4] get-tuple-element(%s0_body.32), index=1
  %s0_y0_row.40 = f32[1,4] reshape(%s0_y0.39)
  %block_first.41 = s64[] constant(0)
  %block_row.42 = s64[] add(%block_first.41, %counter.21)
  ROOT %next_state.43 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) tuple(%next_counter.23, %s0_carry0.33, %xs0.24, %pending_ys0.38, %pass0.30, /*index=5*/%s0_y0_row.40, %block_row.42)
}

%scan_cond0.44 (state.45: (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[])) -> pred[] {
  %state.45 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) parameter(0)
  %counter.46 = s64[] get-tuple-element(%state.45), index=0
  %steps.47 = s64[] constant(2)
  ROOT %more.48 = pred[] compare(%counter.46, %steps.47), direction=LT
}

%scan_entry.49 (carry0.50: f32[4,3], xs0.51: f32[2,4,3], ys0.52: f32[2,4], pass0.53: f32[3,3]) -> (f32[4,3], f32[2,4]) {
  %seg0_counter.54 = s64[] constant(0)
  %carry0.50 = f32[4,3] parameter(0)
  %xs0.51 = f32[2,4,3] parameter(1)
  %ys0.52 = f32[2,4] parameter(2)
  %pass0.53 = f32[3,3] parameter(3)
  %seg0_block0.55 = f32[1,4] constant({ { 1.4013e-45, 0, 0, 0 } })
  %seg0_block_first.56 = s64[] constant(0)
  %seg0_block_row.57 = s64[] add(%seg0_block_first.56, %seg0_counter.54)
  %seg0_init.58 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) tuple(%seg0_counter.54, %carry0.50, %xs0.51, %ys0.52, %pass0.53, /*index=5*/%seg0_block0.55, %seg0_block_row.57)
  %seg0_while.59 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) while(%seg0_init.58), condition=%scan_cond0.44, body=%scan_loop0.19
  %seg0_carry0.60 = f32[4,3] get-tuple-element(%seg0_while.59), index=1
  %seg0_ys0.61 = f32[2,4] get-tuple-element(%seg0_while.59), index=3
  %seg0_block0.62 = f32[1,4] get-tuple-element(%seg0_while.59), index=5
  %seg0_offset0.63 = s64[] get-tuple-element(%seg0_while.59), index=6
  %seg0_last_zero0.64 = s64[] constant(0)
  %seg0_last_ys0.65 = f32[2,4] dynamic-update-slice(%seg0_ys0.61, %seg0_block0.62, %seg0_offset0.63, %seg0_last_zero0.64)
  ROOT %result.66 = (f32[4,3], f32[2,4]) tuple(%seg0_carry0.60, %seg0_last_ys0.65)
}

ENTRY %IrToHlo.67 (p0.68: f32[3,3], p1.69: f32[2,4,3], p2.70: f32[4,3]) -> (f32[4,3], f32[2,4]) {
  %p2.70 = f32[4,3] parameter(2)
  %p1.69 = f32[2,4,3] parameter(1)
  %constant.71 = f32[] constant(0)
  %reshape.72 = f32[1,1] reshape(%constant.71)
  %broadcast.73 = f32[1,1] broadcast(%reshape.72), dimensions={0,1}
  %reshape.74 = f32[] reshape(%broadcast.73)
  %broadcast.75 = f32[2,4] broadcast(%reshape.74), dimensions={}
  %p0.68 = f32[3,3] parameter(0)
  %call.76 = (f32[4,3], f32[2,4]) call(%p2.70, %p1.69, %broadcast.75, %p0.68), to_apply=%scan_entry.49
  %get-tuple-element.77 = f32[4,3] get-tuple-element(%call.76), index=0
  %get-tuple-element.78 = f32[2,4] get-tuple-element(%call.76), index=1
  ROOT %tuple.79 = (f32[4,3], f32[2,4]) tuple(%get-tuple-element.77, %get-tuple-element.78)
}""")

    def test_rnn_reverse(self):
        self.assertExpectedInline(rnn_scan_hlo(reverse=True), """\
%AddComputation.1 (x.2: f32[], y.3: f32[]) -> f32[] {
  %x.2 = f32[] parameter(0)
  %y.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(%x.2, %y.3)
}

%scan_body.5 (p0.6: f32[4,3], p1.7: f32[3,3], p2.8: f32[4,3]) -> (f32[4,3], f32[4]) {
  %constant.9 = s32[] constant(3)
  %p2.8 = f32[4,3] parameter(2)
  %p1.7 = f32[3,3] parameter(1)
  %dot.10 = f32[4,3] dot(%p2.8, %p1.7), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %p0.6 = f32[4,3] parameter(0)
  %constant.11 = f32[] constant(1)
  %broadcast.12 = f32[4,3] broadcast(%constant.11), dimensions={}
  %multiply.13 = f32[4,3] multiply(%p0.6, %broadcast.12)
  %add.14 = f32[4,3] add(%dot.10, %multiply.13)
  %tanh.15 = f32[4,3] tanh(%add.14)
  %constant.16 = f32[] constant(0)
  %reduce.17 = f32[4] reduce(%tanh.15, %constant.16), dimensions={1}, to_apply=%AddComputation.1
  ROOT %tuple.18 = (f32[4,3], f32[4]) tuple(%tanh.15, %reduce.17)
}

%scan_loop0.19 (state.20: (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[])) -> (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) {
  %state.20 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) parameter(0)
  %counter.21 = s64[] get-tuple-element(%state.20), index=0
  %unroll.22 = s64[] constant(1)
  %next_counter.23 = s64[] add(%counter.21, %unroll.22)
  %xs0.24 = f32[2,4,3] get-tuple-element(%state.20), index=2
  %s0_last.25 = s64[] constant(1)
  %s0_idx.26 = s64[] subtract(%s0_last.25, %counter.21)
  %s0_zero.27 = s64[] constant(0)
  %s0_x0_row.28 = f32[1,4,3] dynamic-slice(%xs0.24, %s0_idx.26, %s0_zero.27, %s0_zero.27), dynamic_slice_sizes={1,4,3}
  %s0_x0.29 = f32[4,3] reshape(%s0_x0_row.28)
  %pass0.30 = f32[3,3] get-tuple-element(%state.20), index=4
  %carry0.31 = f32[4,3] get-tuple-element(%state.20), index=1
  %s0_body.32 = (f32[4,3], f32[4]) call(%s0_x0.29, %pass0.30, %carry0.31), to_apply=%scan_body.5
  %s0_carry0.33 = f32[4,3] get-tuple-element(%s0_body.32), index=0
  %ys0.34 = f32[2,4] get-tuple-element(%state.20), index=3
  %block0.35 = f32[1,4] get-tuple-element(%state.20), index=5
  %offset0.36 = s64[] get-tuple-element(%state.20), index=6
  %pending_zero0.37 = s64[] constant(0)
  %pending_ys0.38 = f32[2,4] dynamic-update-slice(%ys0.34, %block0.35, %offset0.36, %pending_zero0.37)
  %s0_y0.39 = f32[4] get-tuple-element(%s0_body.32), index=1
  %s0_y0_row.40 = f32[1,4] reshape(%s0_y0.39)
  %block_last.41 = s64[] constant(1)
  %block_row.42 = s64[] subtract(%block_last.41, %counter.21)
  ROOT %next_state.43 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) tuple(%next_counter.23, %s0_carry0.33, %xs0.24, %pending_ys0.38, %pass0.30, /*index=5*/%s0_y0_row.40, %block_row.42)
}

%scan_cond0.44 (state.45: (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[])) -> pred[] {
  %state.45 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) parameter(0)
  %counter.46 = s64[] get-tuple-element(%state.45), index=0
  %steps.47 = s64[] constant(2)
  ROOT %more.48 = pred[] compare(%counter.46, %steps.47), direction=LT
}

%scan_entry.49 (carry0.50: f32[4,3], xs0.51: f32[2,4,3], ys0.52: f32[2,4], pass0.53: f32[3,3]) -> (f32[4,3], f32[2,4]) {
  %seg0_counter.54 = s64[] constant(0)
  %carry0.50 = f32[4,3] parameter(0)
  %xs0.51 = f32[2,4,3] parameter(1)
  %ys0.52 = f32[2,4] parameter(2)
  %pass0.53 = f32[3,3] parameter(3)
  %seg0_block0.55 = f32[1,4] constant({ { 1.4013e-45, 0, 0, 0 } })
  %seg0_block_last.56 = s64[] constant(1)
  %seg0_block_row.57 = s64[] subtract(%seg0_block_last.56, %seg0_counter.54)
  %seg0_init.58 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) tuple(%seg0_counter.54, %carry0.50, %xs0.51, %ys0.52, %pass0.53, /*index=5*/%seg0_block0.55, %seg0_block_row.57)
  %seg0_while.59 = (s64[], f32[4,3], f32[2,4,3], f32[2,4], f32[3,3], /*index=5*/f32[1,4], s64[]) while(%seg0_init.58), condition=%scan_cond0.44, body=%scan_loop0.19
  %seg0_carry0.60 = f32[4,3] get-tuple-element(%seg0_while.59), index=1
  %seg0_ys0.61 = f32[2,4] get-tuple-element(%seg0_while.59), index=3
  %seg0_block0.62 = f32[1,4] get-tuple-element(%seg0_while.59), index=5
  %seg0_offset0.63 = s64[] get-tuple-element(%seg0_while.59), index=6
  %seg0_last_zero0.64 = s64[] constant(0)
  %seg0_last_ys0.65 = f32[2,4] dynamic-update-slice(%seg0_ys0.61, %seg0_block0.62, %seg0_offset0.63, %seg0_last_zero0.64)
  ROOT %result.66 = (f32[4,3], f32[2,4]) tuple(%seg0_carry0.60, %seg0_last_ys0.65)
}

ENTRY %IrToHlo.67 (p0.68: f32[3,3], p1.69: f32[2,4,3], p2.70: f32[4,3]) -> (f32[4,3], f32[2,4]) {
  %p2.70 = f32[4,3] parameter(2)
  %p1.69 = f32[2,4,3] parameter(1)
  %constant.71 = f32[] constant(0)
  %reshape.72 = f32[1,1] reshape(%constant.71)
  %broadcast.73 = f32[1,1] broadcast(%reshape.72), dimensions={0,1}
  %reshape.74 = f32[] reshape(%broadcast.73)
  %broadcast.75 = f32[2,4] broadcast(%reshape.74), dimensions={}
  %p0.68 = f32[3,3] parameter(0)
  %call.76 = (f32[4,3], f32[2,4]) call(%p2.70, %p1.69, %broadcast.75, %p0.68), to_apply=%scan_entry.49
  %get-tuple-element.77 = f32[4,3] get-tuple-element(%call.76), index=0
  %get-tuple-element.78 = f32[2,4] get-tuple-element(%call.76), index=1
  ROOT %tuple.79 = (f32[4,3], f32[2,4]) tuple(%get-tuple-element.77, %get-tuple-element.78)
}""")

    def test_rnn_straight_line(self):
        """unroll == length: the steps in a row, no While (csrc/hlo_straight.h); each y is the
        concatenation of its rows, so the scan takes no ys buffer and the graph fills none."""
        self.assertExpectedInline(rnn_scan_hlo(reverse=False, unroll=2), """\
%AddComputation.1 (x.2: f32[], y.3: f32[]) -> f32[] {
  %x.2 = f32[] parameter(0)
  %y.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(%x.2, %y.3)
}

%scan_body.5 (p0.6: f32[4,3], p1.7: f32[3,3], p2.8: f32[4,3]) -> (f32[4,3], f32[4]) {
  %constant.9 = s32[] constant(3)
  %p2.8 = f32[4,3] parameter(2)
  %p1.7 = f32[3,3] parameter(1)
  %dot.10 = f32[4,3] dot(%p2.8, %p1.7), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %p0.6 = f32[4,3] parameter(0)
  %constant.11 = f32[] constant(1)
  %broadcast.12 = f32[4,3] broadcast(%constant.11), dimensions={}
  %multiply.13 = f32[4,3] multiply(%p0.6, %broadcast.12)
  %add.14 = f32[4,3] add(%dot.10, %multiply.13)
  %tanh.15 = f32[4,3] tanh(%add.14)
  %constant.16 = f32[] constant(0)
  %reduce.17 = f32[4] reduce(%tanh.15, %constant.16), dimensions={1}, to_apply=%AddComputation.1
  ROOT %tuple.18 = (f32[4,3], f32[4]) tuple(%tanh.15, %reduce.17)
}

%scan_entry.19 (carry0.20: f32[4,3], xs0.21: f32[2,4,3], pass0.22: f32[3,3]) -> (f32[4,3], f32[2,4]) {
  %xs0.21 = f32[2,4,3] parameter(1)
  %s1_idx.23 = s64[] constant(1)
  %s1_zero.24 = s64[] constant(0)
  %s1_x0_row.25 = f32[1,4,3] dynamic-slice(%xs0.21, %s1_idx.23, %s1_zero.24, %s1_zero.24), dynamic_slice_sizes={1,4,3}
  %s1_x0.26 = f32[4,3] reshape(%s1_x0_row.25)
  %pass0.22 = f32[3,3] parameter(2)
  %s0_idx.27 = s64[] constant(0)
  %s0_zero.28 = s64[] constant(0)
  %s0_x0_row.29 = f32[1,4,3] dynamic-slice(%xs0.21, %s0_idx.27, %s0_zero.28, %s0_zero.28), dynamic_slice_sizes={1,4,3}
  %s0_x0.30 = f32[4,3] reshape(%s0_x0_row.29)
  %carry0.20 = f32[4,3] parameter(0)
  %s0_body.31 = (f32[4,3], f32[4]) call(%s0_x0.30, %pass0.22, %carry0.20), to_apply=%scan_body.5
  %s0_carry0.32 = f32[4,3] get-tuple-element(%s0_body.31), index=0
  %s1_body.33 = (f32[4,3], f32[4]) call(%s1_x0.26, %pass0.22, %s0_carry0.32), to_apply=%scan_body.5
  %s1_carry0.34 = f32[4,3] get-tuple-element(%s1_body.33), index=0
  %s0_y0.35 = f32[4] get-tuple-element(%s0_body.31), index=1
  %s0_y0_row.36 = f32[1,4] reshape(%s0_y0.35)
  %s1_y0.37 = f32[4] get-tuple-element(%s1_body.33), index=1
  %s1_y0_row.38 = f32[1,4] reshape(%s1_y0.37)
  %ys0.39 = f32[2,4] concatenate(%s0_y0_row.36, %s1_y0_row.38), dimensions={0}
  ROOT %result.40 = (f32[4,3], f32[2,4]) tuple(%s1_carry0.34, %ys0.39)
}

ENTRY %IrToHlo.41 (p0.42: f32[3,3], p1.43: f32[2,4,3], p2.44: f32[4,3]) -> (f32[4,3], f32[2,4]) {
  %p2.44 = f32[4,3] parameter(2)
  %p1.43 = f32[2,4,3] parameter(1)
  %p0.42 = f32[3,3] parameter(0)
  %call.45 = (f32[4,3], f32[2,4]) call(%p2.44, %p1.43, %p0.42), to_apply=%scan_entry.19
  %get-tuple-element.46 = f32[4,3] get-tuple-element(%call.45), index=0
  %get-tuple-element.47 = f32[2,4] get-tuple-element(%call.45), index=1
  ROOT %tuple.48 = (f32[4,3], f32[2,4]) tuple(%get-tuple-element.46, %get-tuple-element.47)
}""")
