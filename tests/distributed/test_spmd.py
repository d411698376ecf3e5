"""XLA SPMD: sharding annotations in scan bodies, sharded closures, carries, xs and
scan_layers weights, on 4 virtual CPU devices.

SPMD mode and the device count are process-wide and fixed when torch_xla starts,
so every check runs in one child interpreter started for them (``_isolated.SPMD``);
a native crash fails that test with the signal it died of. The checks themselves
are in spmd_cases.py: each compares scan on sharded XLA tensors with the plain
Python loop on unsharded CPU tensors (values and gradients), and asserts that
each sharded input's gradient comes out with that input's sharding.

The cases follow torch_xla's test/scan/test_scan_spmd.py (cumsum, 2D
("fsdp", "tensor") sharding, the einsum-patched linear), with our scan in place
of torch_xla's.
"""
import os

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
import _isolated


def spmd(func, *args):
    _isolated.call("spmd_cases", func, *args, env=_isolated.SPMD)


@pytest.mark.parametrize("where, with_y", [
    ("carry_out", False),  # issue 34's segfault: the carry's gradient reaches the annotation straight
    ("carry_out", True),
    ("carry_in", False),
    ("x", True),
    ("none", False),  # only the inputs are sharded
])
def test_scan_2d_sharding(where, with_y):
    """A closed-over weight sharded ("fsdp", "tensor"), carry and xs sharded, the body
    annotating with mark_sharding_with_gradients; gradients on."""
    spmd("check_annotated_body", where, with_y)


def test_body_annotation_of_unsharded_inputs():
    spmd("check_unsharded_inputs_sharded_in_body")


def test_annotated_bodies_are_captured_not_retraced():
    spmd("check_annotated_bodies_are_captured_not_retraced")


def test_while_hlo_keeps_the_annotations():
    spmd("check_hlo_keeps_annotations")


def test_in_place_mark_sharding_in_a_body_is_a_scan_error():
    spmd("check_in_place_mark_sharding_is_a_scan_error")


def test_scan_layers_over_sharded_weights():
    spmd("check_scan_layers_sharded_weights")


def test_rebuilt_carry_in_sharded_layers():
    spmd("check_rebuilt_carry_in_sharded_layers")


@pytest.mark.parametrize("how", ["per_layer", "auto_wrap", "own_shard_output"])
def test_scan_layers_over_torch_xla_fsdp_v2_layers(how):
    _isolated.call("spmd_fsdp_v2_cases", "check_fsdp_v2_layers", how, env=_isolated.SPMD)


def test_fsdp_v2_module_in_a_scan_body_is_a_clear_error_with_a_way_out():
    _isolated.call("spmd_fsdp_v2_cases", "check_fsdp_v2_module_in_a_scan_body", env=_isolated.SPMD)


RANDOM_CASES = int(os.environ.get("SCAN_SPMD_FUZZ_CASES", "16"))


@pytest.mark.parametrize("part", range(2))
def test_random_sharded_scans_match_the_loop(part):
    """Random meshes, uneven shapes, lengths 0-5, reverse, remat, unroll and annotation points:
    values and gradients as the CPU loop's (``spmd_random_cases``)."""
    half = -(-RANDOM_CASES // 2)
    _isolated.call("spmd_random_cases", "check_random_sharded_scans", 7000 + part * half, half, env=_isolated.SPMD)


def test_random_sharded_layer_stacks_match_the_loop():
    """Random MLP stacks with weights sharded by random specs, remat and unroll: scan_layers'
    output and gradients as the CPU loop's (``spmd_random_cases``)."""
    _isolated.call("spmd_random_cases", "check_random_sharded_layer_stacks", 7100, RANDOM_CASES // 2,
                   env=_isolated.SPMD)


@pytest.mark.parametrize("name, style, mesh_shape, unroll", [
    ("llama_tp", "megatron", (2, 2), 1),
    ("bart", "fsdp", (4,), 2),  # 2 layers: straight-line
])
def test_hugging_face_layers_sharded(name, style, mesh_shape, unroll):
    """Hugging Face layers with weights sharded as trainers shard them (Megatron-style on a 2x2
    mesh, in a While; FSDP-style over 4 devices, straight-line): scan_layers' output and every
    gradient as the model's own loop on the CPU (``spmd_hf_cases``)."""
    pytest.importorskip("transformers")
    _isolated.call("spmd_hf_cases", "check_hf_layers_sharded", name, style, mesh_shape, unroll, env=_isolated.SPMD)


def test_scan_model_over_sharded_layers():
    """A whole Llama through ``scan_model`` (one While), its layers' weights sharded Megatron-style on
    a 2x2 mesh: logits and every gradient as the unscanned model's on the CPU (``spmd_hf_cases``)."""
    pytest.importorskip("transformers", minversion="5")
    _isolated.call("spmd_hf_cases", "check_scan_model_sharded", "llama", "megatron", (2, 2), env=_isolated.SPMD)


def test_scan_cumsum_outputs_sharded_like_inputs():
    spmd("check_cumsum_output_shardings")


def test_scan_xla_patched_linear():
    spmd("check_xla_patched_linear_keeps_leading_dims")


def test_scan_xla_patched_linear_bf16_numerics():
    """torch_xla's test compares with a CPU loop at 1e-3, which bf16 on the CPU misses
    (by ~2-4e-3, torch_xla's own scan too): ours equals torch_xla's scan_layers and the loop on XLA."""
    spmd("check_bf16_numerics_match_torch_xla_scan")


def test_a_crash_in_the_spmd_child_fails_the_test_with_its_signal():
    with pytest.raises(AssertionError, match="signal SIGSEGV"):
        spmd("crash_for_test")
    spmd("check_hlo_keeps_annotations")  # a fresh child serves the next call
