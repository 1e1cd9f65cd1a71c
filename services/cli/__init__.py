"""`llmserve`: the command-line client (generate, chat, models, predict, load, unload, top)."""
