"""Ops as a policy names them, cast categories, and torch's autocast op lists as data.

torch keeps its autocast lists in C++ (``aten/src/ATen/autocast_mode.cpp``). They are
copied here by category, one table per device type. The tables name every op that
any supported torch release puts in a list; :func:`torch_default_rules` keeps only
the ops that the *installed* torch actually registers an autocast kernel for, so
the default policy follows the release in use (``rms_norm`` joined CUDA's float32
list in 2.12, for example) without a version table to maintain by hand.

Ops are named by their ATen name without overload (``"mm"``, ``"linalg_vecdot"``,
``"cross_entropy_loss"``). Within one device's list, all overloads of an op share
one category, so the overload is not needed.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped._internal.torch_compat import aten_op_names, has_kernel_for

__all__ = [
    "TORCH_OP_TABLES",
    "Cast",
    "OpKey",
    "check_op",
    "known_aten_ops",
    "op_label",
    "registered_autocast_ops",
    "torch_default_rules",
]

OpKey = str | Callable[..., Any]
"""An op: its ATen name (``"mm"``, ``"softmax"``), a custom op's qualified name
(``"mylib::fused_gelu"``), or a Python callable (a function decorated with
:func:`amped.autocast_op`, a ``torch.library.custom_op``, a ``torch.ops`` packet),
matched by identity."""


class Cast(enum.Enum):
    """What autocast does with the floating-point inputs of an op.

    The first five mirror torch's ``CastPolicy``; the last three are amped's own.

    Attributes:
        LOWER: cast to the region's low dtype (float16 or bfloat16). torch:
            ``lower_precision_fp``.
        FP32: cast to float32. torch: ``fp32``.
        FP32_SET_OPT_DTYPE: ops with an optional ``dtype`` argument (softmax, sum,
            cumsum, ...): when the caller gave none, pass ``dtype=torch.float32``.
            torch: ``fp32_set_opt_dtype``.
        FP32_APPEND_DTYPE: ``norm``: when the caller gave no dtype, pass
            ``dtype=torch.float32``. torch: ``fp32_append_dtype``.
        PROMOTE: cast all floating inputs to the widest floating type among them.
            torch: ``promote``.
        FP32_LOW_OUT: compute in float32 and cast floating outputs back to the low
            dtype. For norms whose float32 output would otherwise keep every later
            activation in float32 (and double its memory). amped only.
        KEEP: leave the inputs as they are, and keep torch's own autocast from
            casting them either. Moves an op out of torch's lists. amped only.
        BANNED: refuse to run inside an autocast region (torch bans
            ``binary_cross_entropy`` on CUDA).
    """

    LOWER = "lower"
    FP32 = "fp32"
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    FP32_APPEND_DTYPE = "fp32_append_dtype"
    PROMOTE = "promote"
    FP32_LOW_OUT = "fp32_low_out"
    KEEP = "keep"
    BANNED = "banned"

    def __repr__(self) -> str:
        return f"Cast.{self.name}"


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# --- CPU (AutocastCPU) -------------------------------------------------------------

_CPU_LOWER = _names("""
    conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm
    linear _convolution matmul conv_tbc mkldnn_rnn_layer conv_transpose1d
    conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
    _native_multi_head_attention
""")

_CPU_FP32 = _names("""
    avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft
    cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace
    view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr
    ormqr pinverse max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d
    reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
    replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss
    huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss ctc_loss kl_div multilabel_margin_loss
    binary_cross_entropy_with_logits
    fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2
    fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft
    linalg_cond linalg_matrix_rank linalg_solve linalg_cholesky linalg_svdvals
    linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product
    linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf
    _lu_with_info qr svd triangular_solve fractional_max_pool2d fractional_max_pool3d
    adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex
    linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex
""")

_CPU_PROMOTE = _names("stack cat index_copy")

# --- CUDA (AutocastCUDA) ------------------------------------------------------------

_CUDA_LOWER = _names("""
    _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
    conv_transpose3d convolution prelu addmm addmv addr matmul einsum mm mv
    linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
    _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell
    rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
    cudnn_convolution cudnn_convolution_transpose _cudnn_rnn
""")
# _cudnn_rnn's kernel exists only in CUDA builds with cuDNN; it also re-flattens the cast
# weights, which is why amped's engine leaves RNN modules to torch (docs/engine.md).

_CUDA_FP32 = _names("""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow
    softplus layer_norm native_layer_norm group_norm rms_norm frobenius_norm
    nuclear_norm cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss
    nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss
    margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
    logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
    _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d
    upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
    upsample_bicubic2d _upsample_bicubic2d_aa
""")

_CUDA_FP32_SET_OPT_DTYPE = _names("""
    prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum
""")

_CUDA_FP32_APPEND_DTYPE = _names("norm")

_CUDA_PROMOTE = _names("""
    addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
    scatter_add
""")

_CUDA_BANNED = _names("binary_cross_entropy")


def _table(**groups: tuple[str, ...]) -> dict[str, Cast]:
    table: dict[str, Cast] = {}
    for category, names in groups.items():
        for name in names:
            if name in table:
                raise AssertionError(f"{name} is listed twice")  # a bug in this file
            table[name] = Cast[category.upper()]
    return table


TORCH_OP_TABLES: dict[str, dict[str, Cast]] = {
    "cpu": _table(lower=_CPU_LOWER, fp32=_CPU_FP32, promote=_CPU_PROMOTE),
    "cuda": _table(
        lower=_CUDA_LOWER,
        fp32=_CUDA_FP32,
        fp32_set_opt_dtype=_CUDA_FP32_SET_OPT_DTYPE,
        fp32_append_dtype=_CUDA_FP32_APPEND_DTYPE,
        promote=_CUDA_PROMOTE,
        banned=_CUDA_BANNED,
    ),
}
"""Every op torch has listed for each device type, by category (a superset of any release)."""

_DISPATCH_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def _aten_name(qualified: str) -> str:
    """``"aten::norm.ScalarOpt_dtype"`` -> ``"norm"``."""
    return qualified[len("aten::") :].split(".")[0]


@functools.cache
def known_aten_ops() -> frozenset[str]:
    """Every ATen op (no overload) the installed torch registers."""
    return frozenset(_aten_name(n) for n in aten_op_names() if n.startswith("aten::"))


@functools.cache
def registered_autocast_ops(device_type: str) -> frozenset[str]:
    """ATen ops (no overload) for which the installed torch registers an autocast kernel."""
    key = _DISPATCH_KEYS[device_type]
    return frozenset(
        _aten_name(n) for n in aten_op_names() if n.startswith("aten::") and has_kernel_for(n, key)
    )


def torch_default_rules(device_type: str) -> dict[str, Cast]:
    """torch's autocast rules for ``device_type`` as the installed release has them."""
    registered = registered_autocast_ops(device_type)
    return {name: cast for name, cast in TORCH_OP_TABLES[device_type].items() if name in registered}


def op_label(op: OpKey) -> str:
    """A readable name for an op key: the ATen name, or module.qualname of a callable."""
    if isinstance(op, str):
        return op
    module = getattr(op, "__module__", None)
    name = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or repr(op)
    return f"{module}.{name}" if module else name


def _custom_op_exists(qualified: str) -> bool:
    namespace, _, name = qualified.partition("::")
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def check_op(op: object) -> OpKey:
    """``op`` if a policy can name it: a registered ATen or custom op name, or a callable."""
    if isinstance(op, str) and "::" in op:
        if not _custom_op_exists(op):
            raise value_error(
                f"No custom op {op!r} is registered; define it with torch.library first, "
                "or pass the op object itself",
                "op",
                op,
            )
        return op
    if isinstance(op, str):
        if op not in known_aten_ops():
            raise value_error(
                f"Unknown op name {op!r}: a policy names ops by their ATen name without "
                "overload (e.g. 'mm', 'softmax', 'layer_norm', 'linalg_vecdot') or by the "
                "Python callable itself",
                "op",
                op,
            )
        return op
    if not callable(op):
        raise type_error("A policy op must be an ATen op name or a callable", "op", op)
    return op
