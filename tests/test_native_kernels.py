"""The C kernels' ctypes declarations are checked against the signatures the C files state, so a
declaration that drifts from its function leaves the kernel to torch instead of corrupting memory."""

import logging

import pytest

from kernels import cpu_attention, cpu_linear, cpu_norm, native, rotary

pytestmark = pytest.mark.skipif(native.load("cpu_norm") is None, reason="no C compiler here")


@pytest.mark.parametrize("getter", [cpu_attention.native_kernel, lambda: cpu_attention.native_kernel("paged_attention_i8"),
                                    lambda: cpu_attention.native_kernel("paged_attention_f8"),
                                    cpu_linear.native_kernel, cpu_linear.gemm_kernel, cpu_norm.native_kernel,
                                    rotary.native_kernel, lambda: rotary.native_kernel("rotate_and_write_i8"),
                                    lambda: rotary.native_kernel("rotate_and_write_f8")])
def test_every_kernel_loads_with_the_signature_its_c_file_states(getter):
    assert getter() is not None


def test_a_declaration_that_differs_from_the_c_signature_is_refused(caplog):
    p, i = native.POINTER, native.INT64
    with caplog.at_level(logging.ERROR, logger="pagedserve.kernels"):
        kernel = native.function("cpu_norm", "rms_norm_f32", [p, p, p, i, p, i, i, i], i)  # eps as an int64
    assert kernel is None
    assert "rms_norm_f32 takes pppfpiii:i, where its caller passes pppipiii:i" in caplog.text
