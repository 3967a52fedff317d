"""The main job: Megatron-style arguments, the trainer, schedules, checkpoints, evaluate and generate."""
