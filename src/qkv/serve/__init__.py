"""`qkv serve`: a model behind OpenAI's API (chat, completions, models) and a chat page, over qkv.engine."""
