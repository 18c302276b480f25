"""Long instruction data from your own documents through any OpenAI-compatible model: ``longalign data``.

documents.py      documents read, cut to a token range at a paragraph break, or skipped
prompts.py        the prompt files in prompts/ and their overrides
stage.py          samples made concurrently (calls through longalign.answers), written in input order as
                  data.jsonl + calls.jsonl + report.json
self_instruct.py  document -> instruction -> answer (and follow-up turns)
agentwrite.py     writing prompt -> numbered plan -> paragraphs
command.py        the flags of ``longalign data self-instruct|agentwrite``
"""
