import sys

from .base import earlysignals

earlysignals.hold()  # before the imports below, which take a while on a busy host

from .cli.main import main  # noqa: E402

sys.exit(main())
