"""Tool calling for chat completions: which tools a request offers and how calls come out (choice.py),
the parsers of the formats models write calls in (parsers.py), and streaming them (streaming.py)."""
