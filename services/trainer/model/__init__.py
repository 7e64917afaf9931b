"""The trainer's model: the DeepSpeed engine and the PPO actor, log-probs and the fused head,
micro-batches and packing, LoRA, the reference model, ZeRO stages, the weights' gather, the ranks'
collective and checkpoints. It sees tensors and batches, never a message."""
