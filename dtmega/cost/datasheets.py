"""Dense peak TFLOP/s from vendor datasheets: (bf16/fp16 tensor core, fp32 without TF32). One table
for the planner's hardware files and the trainer's MFU; a leaf module (imports nothing)."""

GPU_PEAK_TFLOPS = {
    "B200": (2250.0, 80.0), "H200": (989.4, 66.9), "H100 SXM": (989.4, 66.9), "H100 PCIe": (756.0, 51.2),
    "H100": (989.4, 66.9), "A100": (312.0, 19.5), "L40S": (362.1, 91.6), "L4": (121.0, 30.3), "A10G": (70.0, 31.2),
    "A10": (125.0, 31.2), "V100": (125.0, 15.7), "RTX 4090": (165.2, 82.6), "RTX 3090": (71.0, 35.6),
}
