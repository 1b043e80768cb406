"""The tensor-parallel GEMM shapes the TP benchmarks share (``tp_gemm.py``, ``gemm_tiles.py``,
``scaling.py``): (M, K, N) of one rank's GEMM, M the rows of the whole product."""

# The shapes: all-gather GEMM, reduce-scatter GEMM, all-reduce GEMM.
AG_SHAPES = [(8192, 8192, 14336), (4096, 8192, 14336), (1024, 8192, 14336), (8192, 4096, 6144)]
RS_SHAPES = [(8192, 14336, 8192), (4096, 14336, 8192), (1024, 14336, 8192)]
AR_SHAPES = [(128, 14336, 8192), (1024, 14336, 8192)]

# One rank's GEMM (M, K, N) of the MLP layers of real models under tensor parallelism t:
# the all-gather GEMM is the up projection (K = hidden, N = FFN / t), the reduce-scatter and
# all-reduce GEMMs the down projection (K = FFN / t, N = hidden). M: the rows one rank's GEMM
# computes (prefill/training token counts; decode for the all-reduce), several not multiples
# of 128. Models (hidden, FFN): Llama-3-70B (8192, 28672), Qwen2.5-72B (8192, 29568),
# DeepSeek-V3 dense (7168, 18432), Llama-3-8B (4096, 14336).
FLOOR_SHAPES = [
    *(("ag", s) for s in AG_SHAPES),
    ("ag", (16384, 8192, 3584)),   # Llama-3-70B, TP 8
    ("ag", (3000, 8192, 7392)),    # Qwen2.5-72B, TP 4
    ("ag", (2048, 7168, 9216)),    # DeepSeek-V3, TP 2
    ("ag", (1500, 4096, 7168)),    # Llama-3-8B, TP 2
    *(("rs", s) for s in RS_SHAPES),
    ("rs", (4096, 7168, 8192)),    # Llama-3-70B, TP 4
    ("rs", (16384, 3696, 8192)),   # Qwen2.5-72B, TP 8
    ("rs", (3000, 4608, 7168)),    # DeepSeek-V3, TP 4
    ("rs", (2048, 7168, 4096)),    # Llama-3-8B, TP 2
    ("rs", (1000, 1792, 4096)),    # Llama-3-8B, TP 8
    *(("ar", s) for s in AR_SHAPES),
    ("ar", (256, 14336, 8192)),    # Llama-3-70B, TP 2, decode
    ("ar", (128, 7392, 8192)),     # Qwen2.5-72B, TP 4, decode
    ("ar", (200, 2304, 7168)),     # DeepSeek-V3, TP 8, decode
    ("ar", (256, 11008, 4096)),    # the slowest decode shape
    ("ar", (256, 3584, 4096)),     # Llama-3-8B, TP 4, decode
    ("ar", (32, 14336, 8192)),     # Llama-3-70B, TP 2, decode of 32 sequences
    ("ar", (16, 4608, 7168)),      # DeepSeek-V3, TP 4, decode of 16
    ("ar", (1, 7168, 4096)),       # Llama-3-8B, TP 2, decode of one sequence
    ("ar", (64, 3584, 8192)),      # Llama-3-70B, TP 8, decode of 64
    ("ar", (8, 9216, 7168)),       # DeepSeek-V3, TP 2, decode of 8
    ("ar", (48, 7392, 8192)),      # Qwen2.5-72B, TP 4, decode of 48
    ("ar", (100, 7392, 8192)),     # Qwen2.5-72B, TP 4, decode of 100
    ("ar", (72, 4608, 7168)),      # DeepSeek-V3, TP 4, decode of 72
]
