"""The Hugging Face Trainer under hetrain (imported through hetrain.integrations.transformers,
which checks that transformers is installed first)."""
