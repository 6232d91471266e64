import sys

from . import earlysignals

earlysignals.hold()  # before the imports below, which take a while on a busy host

from .cli import main  # noqa: E402

sys.exit(main())
