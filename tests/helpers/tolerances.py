"""Numerical tolerances used by the tests, each with its reason, in one place."""

# amped promises bitwise identity with torch.autocast under the default policy:
# every comparison against torch.autocast uses these.
BITWISE = dict(rtol=0.0, atol=0.0, equal_nan=True)

# Recipes. The same float32 arithmetic done in another order (a norm of norms against
# one norm, a fused multiply-add against two roundings) differs in the last bits:
# torch's own float32 defaults, which allow a few ulps.
FP32_REORDERED = dict(rtol=1.3e-6, atol=1e-5)

# Stochastic rounding's mean is a binomial estimate: six standard deviations make a
# false failure a one-in-a-billion event while still catching a bias of a few sigma.
SR_SIGMAS = 6.0

# Convergence (tests/recipes/test_recipes_convergence.py). The recipes run the forward pass in
# bfloat16 (8 significant bits), so their losses differ from fp32's by rounding noise
# that does not shrink with training; 2% of the final loss bounds that noise with a wide
# margin and stays far below naive bfloat16's gap. Measured: within 0.3%. Naive
# bfloat16 must be measurably worse: 25% above fp32 is far outside that noise.
# Measured: 89% (SGD) and 84% (AdamW) above.
CONVERGED_REL = 0.02
NAIVE_WORSE = 1.25

# Distributed (tests/distributed/test_distributed.py): 2 processes against 1 on the same global
# batch. The runs differ only in where the batch's sums split: DDP and FSDP2 average
# two half-batch gradients, one process sums the whole batch. Under autocast each
# weight-gradient matmul rounds its result to the low dtype once per half, so the
# gradients differ by about one unit roundoff u of that dtype (2**-8 bfloat16, 2**-11
# float16), relative, at every step; over 8 steps the losses stay within 2u, and the
# parameters within 8u (one u per step) of their tensor's largest entry. The fp32
# recipe differs by reordered float32 sums only, many roundings compounding: 16u
# (u = 2**-24) for both. Measured, worst recipe per dtype: losses 0.6u bf16, 0.5u fp16,
# 1.9u fp32; parameters 2.6u bf16, 1.2u fp16, 2.6u fp32.
DISTRIBUTED_LOSS_UNITS = {"low": 2, "fp32": 16}
DISTRIBUTED_PARAM_UNITS = {"low": 8, "fp32": 16}

# torch.compile with inductor against eager, bfloat16 autocast
# (tests/autocast_mode/test_autocast_compile.py).
# Inductor fuses the pointwise ops around each matmul and computes them in float32,
# rounding to bfloat16 once where eager rounds after every op; and it may reorder
# reductions. Each rounding moves a bfloat16 value by at most half a unit in the last
# place, 2**-9 relative, and a few of them compound through the layer; 4 units (2**-6)
# relative, with an absolute floor for values near zero, allows that and nothing more.
INDUCTOR_BF16 = dict(rtol=2**-6, atol=2**-8)

# The compensated optimizers' fused step against their eager step
# (tests/optim/test_recipes_fused.py). The kernel repeats the eager ops in float32, but three
# kinds of rounding differ by one float32 ulp of an intermediate: eager lerp,
# add(alpha=) and addcmul fuse a multiply and an add (FMA) where the kernel rounds
# twice, and eager sqrt (SLEEF, within 0.5001 ulp) is not always the correctly
# rounded one the kernel computes. Rounded to bfloat16 or float16, such a difference
# moves a stored value by at most one ulp of its dtype, and only when the float32
# value lies within a float32 ulp of a rounding boundary: about one element in 2**13
# for bfloat16 per op and step. 1% of elements bounds that with a wide margin
# (measured: at most 0.02% after 5 steps). Under Kahan compensation the weight plus
# its compensation carries the float32 total to about 16 bits, so the two steps' sums
# agree to a few float32 ulps plus one ulp of the compensation, at most 2**-17 of the
# weight: 2**-14 leaves a margin of 8 (measured: below 2**-20). Where an op cancels
# (lerp of a moment towards a gradient of the opposite sign, a weight near zero), the
# result is small and the float32 difference is an ulp of the operands, not of the
# result: up to FUSED_CANCELLATION float32 ulps of the tensor's largest value are
# allowed on top (measured: 1.1e-9 against a largest moment of 0.2, about 0.1 ulp).
# And where a stored moment or buffer came out one ulp apart (above), every later update
# of that weight differs by up to that ulp, 2**-7 of the update in bfloat16: the Kahan
# sums may differ by FUSED_UPDATE_REL (twice that) of the distance the weight has moved.
# Adam is the exception: it divides each gradient by its own running magnitude, so a
# gradient that cancels (maximize's -grad plus an L2 term of equal size) to exactly 0
# in one step and to a float32 remainder (1e-9, from eager's FMA) in the other gives
# updates of 0 and of up to lr. Such elements must be rare, FUSED_AMPLIFIED of a
# tensor at most (measured: 1 of 19,200 on the L2 + maximize test), and then differ by
# at most lr per step.
FUSED_DIFFERING = 0.01
FUSED_AMPLIFIED = 0.001
FUSED_KAHAN_REL = 2.0**-14
FUSED_CANCELLATION = 4
FUSED_UPDATE_REL = 2.0**-6

# The fused master-weight step against the unfused O2 step
# (tests/optim/test_recipes_master_fused.py).
# The kernel repeats torch's single-tensor Adam/SGD ops with torch's fused multiply-adds,
# bitwise but for one op: eager CPU sqrt (MKL's vector sqrt) is off by one float32 ulp
# on about 0.7% of elements, the kernel's is correctly rounded. That moves Adam's
# denominator by 2**-24 of itself and a master by at most one float32 ulp a step (the
# addcdiv's rounding may then go the other way); masters, and moments through Adam's L2
# term, stay within one ulp of the tensor's largest value per step. A low-precision
# weight differs only where its master lies within that of a rounding boundary, by one
# ulp of its dtype: rare (measured over the test's Adam cases, 4 steps: no weight
# differed, masters within half a float32 ulp of their largest value); 1% bounds it
# with a wide margin. The forward then sees those weights, so losses may differ by
# rounding noise of the low dtype: 2**-8 relative (measured: equal).
MASTER_FUSED_LOW_DIFFERING = 0.01
MASTER_FUSED_LOSS_REL = 2.0**-8
