"""Small, runnable examples: tiny models to try the commands on, and an example evaluator."""
