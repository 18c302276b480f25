"""What the training bought: ``longalign eval needle|ruler|chat|write``.

    longalign eval needle --model out/run --lengths 1000,2000,4000 --output out/eval/needle

Modules: ``models`` (prompts in token ids, local and served generation), ``ranks`` (prompts shared out
over ``accelerate launch`` ranks), ``needle``, ``ruler`` (RULER's synthetic tasks), ``judge``, ``chat``, ``write``, and ``commands`` (the flags).
"""
