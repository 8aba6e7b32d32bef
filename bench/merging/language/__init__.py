"""The language track: SmolLM2-135M-Instruct experts on multiple-choice tasks, scored by lm-eval."""
