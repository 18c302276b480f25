"""Long instruction data from your own documents through any OpenAI-compatible model: ``longalign data``.

documents.py      documents read, cut to a token range at a paragraph break, or skipped
prompts.py        the prompt files in prompts/ and their overrides
calls.py          every finished call kept in a cache next to the output (resume without paying twice)
stage.py          samples made concurrently, written in input order as data.jsonl + report.json
self_instruct.py  document -> instruction -> answer (and follow-up turns)
agentwrite.py     writing prompt -> numbered plan -> paragraphs
command.py        the flags of ``longalign data self-instruct|agentwrite``
"""
