"""The chat-data pipeline behind training/make_chat_data.py: instructions built from material on this machine
(material.py) and word lists (kinds.py), the target's own user turns (Magpie-style), answers decoded by the
target in shrinking batches (decode.py), and a data card (card.py)."""
