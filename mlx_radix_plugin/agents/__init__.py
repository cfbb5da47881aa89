"""Agent clients served directly: Anthropic's Messages API and OpenAI's Responses API over
mlx_lm.server's own generation thread, model and prompt cache."""
