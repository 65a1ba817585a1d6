"""The ``kvcompress`` command line: it parses, checks the flags and outputs before any work, calls the library, and
prints what bench/report.py builds of the results; a library error is shown in the flags' words. One module per
command family, each command's parser beside its handler:

    ask.py          kvcompress generate [--past FILE] | chat | compress
    explore.py      kvcompress methods | demo | observe | fetch-model | fetch-data
    bench.py        kvcompress bench accuracy | speed | headline | shared-context
    serve.py        kvcompress serve
    method_flags.py a method's flags, built and refused in one place
    common.py       the parser, outputs checked before any work, prompts
    main.py         the whole parser and ``main``
"""

from .main import build_parser, in_flag_words, main

__all__ = ["build_parser", "in_flag_words", "main"]
