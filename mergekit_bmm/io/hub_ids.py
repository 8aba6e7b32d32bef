"""Hub repo ids, told apart from local paths without asking the Hub."""

from __future__ import annotations


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` is a valid Hub repo id (checked locally, no Hub call)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not text or text[0] in "/~." or "\\" in text or text.count("/") > 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True
