"""XLA: the While module our builder emits (csrc/hlo_scan.cc), read as pseudo-HLO snapshots, and
the builder's refusals of a bad signature (a ValueError, never a crash)."""
import re

import expecttest
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")

DEV = torch_xla.device()


def _emitted_structure(computation):
    """The scan's own computations (loops, conds, entry), normalized to read
    like pseudo-HLO: no ids, no layouts, no operand types, the loop-state tuple
    type written as State."""
    text = torch_xla._XLAC._xla_computation_text(computation)
    ours = text[text.index("%scan_loop"):]
    ours = re.sub(r"([A-Za-z_][\w-]*)\.\d+", r"\1", ours)  # ids
    ours = re.sub(r"(?<=\])\{[\d,]*\}", "", ours)  # layouts
    ours = re.sub(r"\(s64\[\](?:, (?:/\*index=\d+\*/)?\w+\[[\d,]*\])*\)", "State", ours)
    ours = re.sub(r"(?:\w+\[[\d,]*\]|State|\([^()]*\)) (?=%)", "", ours)  # operand types
    return "\n".join(line.rstrip() for line in ours.strip().splitlines())


class TestEmittedModule(expecttest.TestCase):
    def test_reverse_unrolled_scan_is_one_while_per_segment(self):
        """reverse, unroll=2, length 3: _schedule gives [1, 3) in blocks of 2, then [0, 1)."""
        from torch_scan_hop.xla import lower as xla_lower

        def body(c, x, w):
            h = c * w + x
            return [h, h.sum()]

        z = torch.zeros(2, device=DEV)
        lowered = xla_lower._lower(body, [z], [torch.zeros(3, 2, device=DEV)], (z,), reverse=True, unroll=2)
        self.assertExpectedInline(_emitted_structure(lowered.computation), """\
%scan_loop0 (state: State) -> State {
  %pending_zero0 = s64[] constant(0)
  %state = State parameter(0)
  %counter = s64[] get-tuple-element(%state), index=0
  %unroll = s64[] constant(2)
  %next_counter = s64[] add(%counter, %unroll)
  %xs0 = f32[3,2] get-tuple-element(%state), index=2
  %s1_last = s64[] constant(2)
  %s1_offset = s64[] constant(1)
  %s1_pos = s64[] add(%counter, %s1_offset)
  %s1_idx = s64[] subtract(%s1_last, %s1_pos)
  %s1_zero = s64[] constant(0)
  %s1_x0_row = f32[1,2] dynamic-slice(%xs0, %s1_idx, %s1_zero), dynamic_slice_sizes={1,2}
  %s1_x0 = f32[2] reshape(%s1_x0_row)
  %pass0 = f32[2] get-tuple-element(%state), index=4
  %s0_last = s64[] constant(2)
  %s0_idx = s64[] subtract(%s0_last, %counter)
  %s0_zero = s64[] constant(0)
  %s0_x0_row = f32[1,2] dynamic-slice(%xs0, %s0_idx, %s0_zero), dynamic_slice_sizes={1,2}
  %s0_x0 = f32[2] reshape(%s0_x0_row)
  %carry0 = f32[2] get-tuple-element(%state), index=1
  %s0_body = (f32[2], f32[]) call(%s0_x0, %pass0, %carry0), to_apply=%scan_body
  %s0_carry0 = f32[2] get-tuple-element(%s0_body), index=0
  %s1_body = (f32[2], f32[]) call(%s1_x0, %pass0, %s0_carry0), to_apply=%scan_body
  %s1_carry0 = f32[2] get-tuple-element(%s1_body), index=0
  %ys0 = f32[3] get-tuple-element(%state), index=3
  %block0 = f32[2] get-tuple-element(%state), index=5
  %offset0 = s64[] get-tuple-element(%state), index=6
  %pending_ys0 = f32[3] dynamic-update-slice(%ys0, %block0, %offset0)
  %s1_y0 = f32[] get-tuple-element(%s1_body), index=1
  %s1_y0_row = f32[1] reshape(%s1_y0)
  %s0_y0 = f32[] get-tuple-element(%s0_body), index=1
  %s0_y0_row = f32[1] reshape(%s0_y0)
  %block0 = f32[2] concatenate(%s1_y0_row, %s0_y0_row), dimensions={0}
  %block_last = s64[] constant(1)
  %block_row = s64[] subtract(%block_last, %counter)
  ROOT %next_state = State tuple(%next_counter, %s1_carry0, %xs0, %pending_ys0, %pass0, /*index=5*/%block0, %block_row)
}

%scan_cond0 (state: State) -> pred[] {
  %state = State parameter(0)
  %counter = s64[] get-tuple-element(%state), index=0
  %steps = s64[] constant(2)
  ROOT %more = pred[] compare(%counter, %steps), direction=LT
}

%scan_loop1 (state: State) -> State {
  %pending_zero0 = s64[] constant(0)
  %state = State parameter(0)
  %counter = s64[] get-tuple-element(%state), index=0
  %unroll = s64[] constant(1)
  %next_counter = s64[] add(%counter, %unroll)
  %xs0 = f32[3,2] get-tuple-element(%state), index=2
  %s0_last = s64[] constant(0)
  %s0_idx = s64[] subtract(%s0_last, %counter)
  %s0_zero = s64[] constant(0)
  %s0_x0_row = f32[1,2] dynamic-slice(%xs0, %s0_idx, %s0_zero), dynamic_slice_sizes={1,2}
  %s0_x0 = f32[2] reshape(%s0_x0_row)
  %pass0 = f32[2] get-tuple-element(%state), index=4
  %carry0 = f32[2] get-tuple-element(%state), index=1
  %s0_body = (f32[2], f32[]) call(%s0_x0, %pass0, %carry0), to_apply=%scan_body
  %s0_carry0 = f32[2] get-tuple-element(%s0_body), index=0
  %ys0 = f32[3] get-tuple-element(%state), index=3
  %block0 = f32[1] get-tuple-element(%state), index=5
  %offset0 = s64[] get-tuple-element(%state), index=6
  %pending_ys0 = f32[3] dynamic-update-slice(%ys0, %block0, %offset0)
  %s0_y0 = f32[] get-tuple-element(%s0_body), index=1
  %s0_y0_row = f32[1] reshape(%s0_y0)
  %block_last = s64[] constant(0)
  %block_row = s64[] subtract(%block_last, %counter)
  ROOT %next_state = State tuple(%next_counter, %s0_carry0, %xs0, %pending_ys0, %pass0, /*index=5*/%s0_y0_row, %block_row)
}

%scan_cond1 (state: State) -> pred[] {
  %state = State parameter(0)
  %counter = s64[] get-tuple-element(%state), index=0
  %steps = s64[] constant(1)
  ROOT %more = pred[] compare(%counter, %steps), direction=LT
}

ENTRY %scan_entry (carry0: f32[2], xs0: f32[3,2], ys0: f32[3], pass0: f32[2]) -> (f32[2], f32[3]) {
  %seg0_last_zero0 = s64[] constant(0)
  %seg1_last_zero0 = s64[] constant(0)
  %seg1_counter = s64[] constant(0)
  %seg0_counter = s64[] constant(0)
  %carry0 = f32[2] parameter(0)
  %xs0 = f32[3,2] parameter(1)
  %ys0 = f32[3] parameter(2)
  %pass0 = f32[2] parameter(3)
  %seg0_block0 = f32[2] constant({1.4013e-45, 0})
  %seg0_block_last = s64[] constant(1)
  %seg0_block_row = s64[] subtract(%seg0_block_last, %seg0_counter)
  %seg0_init = State tuple(%seg0_counter, %carry0, %xs0, %ys0, %pass0, /*index=5*/%seg0_block0, %seg0_block_row)
  %seg0_while = State while(%seg0_init), condition=%scan_cond0, body=%scan_loop0
  %seg0_carry0 = f32[2] get-tuple-element(%seg0_while), index=1
  %seg0_xs0 = f32[3,2] get-tuple-element(%seg0_while), index=2
  %seg0_ys0 = f32[3] get-tuple-element(%seg0_while), index=3
  %seg0_block0 = f32[2] get-tuple-element(%seg0_while), index=5
  %seg0_offset0 = s64[] get-tuple-element(%seg0_while), index=6
  %seg0_last_ys0 = f32[3] dynamic-update-slice(%seg0_ys0, %seg0_block0, %seg0_offset0)
  %seg0_pass0 = f32[2] get-tuple-element(%seg0_while), index=4
  %seg1_block0 = f32[1] constant({1.4013e-45})
  %seg1_block_last = s64[] constant(0)
  %seg1_block_row = s64[] subtract(%seg1_block_last, %seg1_counter)
  %seg1_init = State tuple(%seg1_counter, %seg0_carry0, %seg0_xs0, %seg0_last_ys0, %seg0_pass0, /*index=5*/%seg1_block0, %seg1_block_row)
  %seg1_while = State while(%seg1_init), condition=%scan_cond1, body=%scan_loop1
  %seg1_carry0 = f32[2] get-tuple-element(%seg1_while), index=1
  %seg1_ys0 = f32[3] get-tuple-element(%seg1_while), index=3
  %seg1_block0 = f32[1] get-tuple-element(%seg1_while), index=5
  %seg1_offset0 = s64[] get-tuple-element(%seg1_while), index=6
  %seg1_last_ys0 = f32[3] dynamic-update-slice(%seg1_ys0, %seg1_block0, %seg1_offset0)
  ROOT %result = (f32[2], f32[3]) tuple(%seg1_carry0, %seg1_last_ys0)
}""")


@pytest.mark.parametrize("segments, params, body, message", [
    ([(0, 5, 2)], [(0, 0)], b"", "not a multiple of its unroll"),
    ([(0, 6, 1)], [(0, 0)], b"", "segment outside"),
    ([(0, 5, 1)], [(1, 3)], b"", r"body parameter source \(1, 3\) out of range"),
    ([(0, 5, 1)], [(0, 0)], b"\x80", "truncated varint"),
])
def test_builder_rejects_a_bad_signature_without_crashing(segments, params, body, message):
    from torch_scan_hop import _hlo_scan

    f32 = 11
    with pytest.raises(ValueError, match=message):
        _hlo_scan.build_scan_module(body, 5, False, segments, [(f32, (2,))], [(f32, (5, 2))], [], [], params)
