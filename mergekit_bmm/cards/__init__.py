"""Hub-ready model cards, the merge record behind them, and publishing."""
