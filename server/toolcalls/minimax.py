"""MiniMax-M2's calls, read by mlx-lm's minimax_m2 parser:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

One `invoke` per call (several in one block for parallel calls); values are
text, converted by the tool's schema.
"""

from __future__ import annotations

from kvfork.server.toolcalls.xml_calls import NamedElementsParser

_BLOCK = ("<minimax:tool_call>", "</minimax:tool_call>")


class MiniMaxParser(NamedElementsParser):
    name = "minimax_m2"
    reference = "minimax_m2"
    markers = (_BLOCK,)
    block, separator = (_BLOCK[0] + "\n", _BLOCK[1]), ""
    special_markers = _BLOCK
    call_tag, parameter_tag = ("<invoke name=", "</invoke>"), ("<parameter name=", "</parameter>")
    spacing, trail = "\n", "\n"
