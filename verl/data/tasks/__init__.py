"""Built-in tasks."""
