"""The chat service the app talks to: building engines, switching models, the torch worker thread."""
