"""Put on PYTHONPATH by ``detaudit exec``: attaches detaudit's recording before the user's
code runs, in the process the job names (nothing happens without the job variable), then
runs the ``sitecustomize`` this one hides, if there is one."""

import importlib.machinery
import importlib.util
import json
import os
import sys

if os.environ.get("DETAUDIT_ATTACH"):
    try:
        from detaudit.drivers.attach_process import activate_from_environment
    except ImportError as exc:  # a Python without detaudit (or torch): said where exec looks
        _said = f"{sys.executable} cannot import detaudit ({exc})"
        print(f"detaudit: {_said}: this process runs unaudited", file=sys.stderr)
        try:
            _trace = json.loads(os.environ["DETAUDIT_ATTACH"])["trace"]
            with open(_trace + ".unattached", "w") as _note:
                _note.write(_said)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    else:
        activate_from_environment()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_detaudit_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


_chain()
