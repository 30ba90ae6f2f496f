"""`planning.library_calls`: the cuBLAS and cuDNN calls of an optimized GPU module, which
XLA's cost analysis charges -1 FLOPs and -1 bytes each, counted from the module's text.
The lines are XLA:GPU's own (jax 0.12.0.1, a compile-only H100; backend configs cut
short); the expected numbers are worked out by hand from the shapes."""
from __future__ import annotations

from aotgrad.planning.library_calls import LibraryCalls, has_library_calls, library_calls
from aotgrad.planning.loops import counted

_CONV = 'window={size=3x3 stride=2x2}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$conv'
_CONFIG = 'backend_config={"operation_queue_id":"0","cudnn_conv_backend_config":{"activation_mode":"kNone"}}'
_GEMM_CONFIG = ('backend_config={"operation_queue_id":"0","gemm_backend_config":{"selected_algorithm":"0",'
                '"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
                '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')
MODULE = "\n".join([
    "HloModule jit_step",
    "",
    "ENTRY %main.1 (w1.1: f32[3,3,16,32], x.1: f32[8,32,32,16], a.1: f32[1024,2048], "
    "b.1: f32[2048,4096]) -> f32[] {",
    '  %w1.1 = f32[3,3,16,32]{3,2,1,0} parameter(0), metadata={op_name="w1" scheduling_name="w1.1"}',
    '  %x.1 = f32[8,32,32,16]{3,2,1,0} parameter(1), metadata={op_name="x" scheduling_name="x.1"}',
    "  %a.1 = f32[1024,2048]{1,0} parameter(2)",
    "  %b.1 = f32[2048,4096]{1,0} parameter(3)",
    "  %loop_pad_fusion = f32[8,33,33,16]{3,2,1,0} fusion(%x.1), kind=kLoop, calls=%fused_pad",
    "  %wrapped_transpose = f32[32,3,3,16]{3,2,1,0} fusion(%w1.1), kind=kLoop, calls=%wrapped_transpose_computation",
    "  %cudnn-conv.2 = (f32[8,16,16,32]{3,2,1,0}, u8[0]{0}) custom-call(%loop_pad_fusion, %wrapped_transpose), "
    f'{_CONV}Forward", {_CONFIG}',
    "  %get-tuple-element.15 = f32[8,16,16,32]{3,2,1,0} get-tuple-element(%cudnn-conv.2), index=0",
    "  %cudnn-conv-bw-filter.2 = (f32[32,3,3,16]{3,2,1,0}, u8[0]{0}) "
    f'custom-call(%loop_pad_fusion, %get-tuple-element.15), {_CONV}BackwardFilter", {_CONFIG}',
    "  %cudnn-conv-bw-input.2 = (f32[8,33,33,16]{3,2,1,0}, u8[0]{0}) "
    f'custom-call(%get-tuple-element.15, %wrapped_transpose), {_CONV}BackwardInput", {_CONFIG}',
    "  %custom-call.2 = (f32[1024,4096]{1,0}, s8[4194304]{0}) custom-call(%a.1, %b.1), "
    f'custom_call_target="__cublas$lt$matmul", {_GEMM_CONFIG}',
    '  %custom-call.3 = f32[1024,4096]{1,0} custom-call(%custom-call.2), custom_call_target="Sharding", '
    "sharding={replicated}",
    "  %custom-call.4 = (f32[8,4,128,128]{3,2,1,0}, u8[16]{0}) custom-call(%a.1, %b.1), "
    'custom_call_target="__cudnn$fmhaSoftmax"',
    "  ROOT %r = f32[] constant(0)",
    "}",
])

F32 = 4
INPUT_PADDED = 8 * 33 * 33 * 16 * F32
FILTER = 3 * 3 * 16 * 32 * F32
OUTPUT = 8 * 16 * 16 * 32 * F32
# Each convolution: the forward's 8 x 16 x 16 x 32 outputs, 3 x 3 x 16 multiply-adds each.
CONV_FLOPS = 2 * (8 * 16 * 16 * 32) * (3 * 3 * 16)
GEMM_FLOPS = 2 * 1024 * 4096 * 2048
GEMM_BYTES = (1024 * 2048 + 2048 * 4096 + 1024 * 4096) * F32  # not its s8 workspace
FMHA_BYTES = (1024 * 2048 + 2048 * 4096 + 8 * 4 * 128 * 128) * F32


def test_gemm_and_convolution_calls_are_counted_from_their_shapes():
    calls = library_calls(MODULE)
    # The three convolutions, the GEMM and the fused attention; not the "Sharding" marker.
    assert calls.count == 5
    assert calls.unknown == ("__cudnn$fmhaSoftmax",)  # its bytes, no FLOPs
    assert calls.flops == 3 * CONV_FLOPS + GEMM_FLOPS
    conv_bytes = (INPUT_PADDED + FILTER + OUTPUT) * 3  # each reads two of them and writes one
    assert calls.bytes == conv_bytes + GEMM_BYTES + FMHA_BYTES


def test_a_module_without_library_calls_counts_nothing():
    assert library_calls(MODULE.replace("custom-call(", "fusion(")) == LibraryCalls()
    no_libraries = MODULE.replace('"__cudnn$', '"other$').replace('"__cublas$', '"other$')
    assert library_calls(no_libraries) == LibraryCalls()
    assert has_library_calls(MODULE) and not has_library_calls(no_libraries)


def test_a_step_counts_each_library_call_once_with_xlas_own_flops():
    """`loops.counted` finds the calls computation by computation (a loop body's run as often
    as the loop): in a module without loops, the same calls as the whole text holds, their
    FLOPs and bytes added to the analysis's and the -1 it charged each undone."""
    c = counted(MODULE, {"flops": 10.0, "bytes accessed": 20.0}, lambda text: {})
    assert c.calls == library_calls(MODULE)
    assert c.flops == 10.0 + c.calls.count + 3 * CONV_FLOPS + GEMM_FLOPS
    assert c.bytes_accessed == 20.0 + c.calls.count + c.calls.bytes
