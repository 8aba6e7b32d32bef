"""mergekit adapters: each registered method is a thin layer over pure-torch math."""
