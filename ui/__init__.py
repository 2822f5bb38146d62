"""The ChatGPT-style web UI and the code that serves it."""
