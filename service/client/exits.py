"""Every `moe-control` command's exit status, in one table: what each number means.

0 is success; 1 is a clear "no" the caller asked about (vLLM would select no backend, the
layer or server is not there or not ready, the conversion is not supported, a diff found
changes, a run was over its tolerance); 2 is bad input (a flag, a spec, a path: nothing was
sent or done); 3 is the server or the transport failing the call (unreachable, timed out,
refused, an internal error). Ctrl-C and a reader gone away end as a shell reports a tool
killed by that signal.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
#: vLLM would select no backend for the deployment (select, and each cell of a matrix).
EXIT_SELECTION_FAILED = 1
#: The server answered NOT_FOUND (an unknown layer id).
EXIT_NOT_FOUND = 1
#: The server was not ready within --timeout (--wait-ready), or health says NOT_SERVING.
EXIT_NOT_READY = 1
#: The conversion (or kernel) asked for is not supported.
EXIT_UNSUPPORTED = 1
#: `diff`: the answers differ between the rulesets.
EXIT_CHANGED = 1
#: A bad flag, spec, config or path: named in the message; nothing was done.
EXIT_BAD_INPUT = 2
#: The call failed on the server's side or on the way: unreachable, out of time, refused.
EXIT_SERVER_ERROR = 3
#: Ctrl-C (SIGINT): 128 + the signal, as a shell reports it.
EXIT_INTERRUPTED = 128 + signal.SIGINT
#: A reader that went away (`moe-control select ... | head -4`): the status of a tool killed
#: by SIGPIPE, which is how well-behaved Unix tools end there.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
