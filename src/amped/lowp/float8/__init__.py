"""FP8 training (tensorwise, rowwise, delayed and blockwise scaling), as ``torchao.float8``.

- :mod:`.cast`: amax, scale and the saturating cast (``quantize``, ``sqnr``), its
  kernels in :mod:`.fp8_kernel`, run compiled on a CPU by :mod:`.compiled_cast`;
- :mod:`.config`: :class:`~amped.lowp.Float8Config` and the named configs;
- :mod:`.delayed`: delayed (amax-history) scaling state and its per-step update;
- :mod:`.gemm`: ``scaled_mm``, ``torch._scaled_mm`` or its exact emulation;
- :mod:`.linear`: :class:`~amped.lowp.Float8Linear`;
- :mod:`.fsdp_wire`: FSDP2's all-gather of weights cast to FP8;
- :mod:`.blockwise`: casts with one scale per 1x128, 128x1 or 128x128 tile (DeepSeek-V3),
  :mod:`.blockwise_gemm` their GEMM, :mod:`.blockwise_linear` a blockwise layer's GEMMs.

The public names are exported by :mod:`amped.lowp`.
"""
