"""What is done to the HF model: attention, memory policies, precision, parallel, compile, LoRA, RoPE."""
