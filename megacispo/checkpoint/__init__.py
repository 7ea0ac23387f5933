"""Checkpoints: megacispo's distributed checkpoints, the Hugging Face formats, the streaming converter
between them, and Hugging Face directories at run time."""
