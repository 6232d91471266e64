"""safetext.visible: outside text made safe for one journal line, STATUS= or a terminal."""

from gpuwarden.base.safetext import visible


def test_every_control_character_is_written_visibly():
    raw = "/x\x00<0>gpuwarden: GPU0 gpu_needs_reset FORGED\x1b[2J\r\nSTOPPING=1\u2028\x85\x7f\t"
    out = visible(raw)
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f or c in "\u2028\u2029" for c in out)
    assert out == "/x\\x00<0>gpuwarden: GPU0 gpu_needs_reset FORGED\\x1b[2J\\r\\nSTOPPING=1\\u2028\\x85\\x7f\\t"


def test_printable_text_is_left_alone():
    text = "vLLM healthy after 3.2 s on http://127.0.0.1:8000 — é 中 \\ <3>"
    assert visible(text) == text
