"""The serving front: OpenAI-style request handling on top of the engine (sampling, text)."""
