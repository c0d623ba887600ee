"""What the Triton kernels and their launcher agree on: op kinds, and how many fp32 fields a
row of partials or of saved statistics has.

Plain ints, so that ``backend.py`` reads them without importing triton; ``kernels.py``
wraps each in ``tl.constexpr`` under the same name (kernels read only constexpr globals)
and names the offset of every field, which only the kernels read.
"""

# op kinds of the one-input kernels (their KIND constexpr)
CE = 0
LOGPROBS = 1
ENTROPY = 2
# op kinds of the two-input kernels
KL = 0
JSD = 1

# Partials, [P, N, F] fp32 (P = vocabulary splits x ranks): a max-rescaled state per row.
CE_FIELDS = 5  # max, sum, sum (z - a) k2, columns counted, z[label]
LOGPROBS_FIELDS = 2  # max, sum, then z at each of the k index entries: 2 + k in all
# logprobs with return_entropy: an entropy partial (max, sum, sum e (z - a) k2), then z at
# each of the k index entries: 3 + k in all
LOGPROBS_ENTROPY_FIELDS = 3
ENTROPY_FIELDS = 3  # max, sum, sum e (z - a) k2
PAIR_FIELDS = 4  # two inputs: max_a, sum_a, max_b, sum_b
KL_FIELDS = 5  # the same and the unnormalized KL(A || B) term
DIV_FIELDS = 2  # JSD divergence pass: KL(p_s || M), KL(p_t || M) in bits

# Statistics saved for backward, [N, S] fp32.
STATS = 2  # cross_entropy, logprobs: anchor a, log2 sum
ENTROPY_STATS = 3  # and the entropy (nats); also logprobs with return_entropy
KL_STATS = 5  # anchor_a, log2 sum_a, anchor_b, log2 sum_b, KL (nats)
JSD_STATS = 6  # anchor_s, log2 sum_s, anchor_t, log2 sum_t, KL(p_s || M), KL(p_t || M) (nats)

# Reductions a kernel computes itself (its REDUCE constexpr): none, sum, mean.
REDUCE_NONE = 0
REDUCE_SUM = 1
REDUCE_MEAN = 2
# The int32 scratch of a reduced or merged call, zeroed per call: programs done, the count a
# mean divided by (read again by backward), then one arrival counter per row (split rows
# merged by their last program).
R_DONE = 0
R_COUNT = 1
R_ROWS = 2
