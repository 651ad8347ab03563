"""A card's claims: ``card.json["claims"]`` is a list of ``{"id", "value", ...}``; this is the lookup every reader of
a card (the README renderer, the plots, ``card verify``) uses."""
from __future__ import annotations


def claims_by_id(card: dict) -> dict:
    """``{claim id: value}`` of ``card``."""
    return {c["id"]: c["value"] for c in card["claims"]}
