"""GPT-2's byte-level alphabet: how byte-level BPE tokenizers (GPT-2's, Llama 3's, tiktoken's
vocabularies exported to Hugging Face) write each byte as a printable character."""

from __future__ import annotations


def byte_symbols() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE writes for it (GPT-2's table: printable
    Latin-1 bytes stand for themselves, the others are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table
