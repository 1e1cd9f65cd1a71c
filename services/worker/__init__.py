"""The worker: owns the accelerator, the model weights and the paged KV memory; runs steps."""
