"""Built-in tasks: the synthetic arithmetic task, its shipped tokenizer and reward."""
