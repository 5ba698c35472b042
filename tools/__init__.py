"""Developer tools: the README's demo."""
