"""Block-scaled formats (MXFP8, MXFP4, NVFP4), as ``torchao.prototype.mx_formats``.

- :mod:`.block_format`, :mod:`.block_config`: the formats and
  :class:`~amped.lowp.BlockConfig`;
- :mod:`.block_cast` (with :mod:`.block_kernel`, :mod:`.element_round`, :mod:`.e2m1`,
  :mod:`.hadamard`): a tensor cast to blocks;
- :mod:`.block_operand`, :mod:`.block_gemm`: an emulated GEMM's operand and the GEMM;
- :mod:`.block_linear`: :class:`~amped.lowp.BlockLinear`;
- :mod:`.fsdp_block_wire`: FSDP2's all-gather of weights cast to a block format.

The public names are exported by :mod:`amped.lowp`.
"""
