"""The proxy's book of the engine's ends on a clock the test drives (proxy/casualties.py, proxy/ends.py): the clock,
a hold whose looks at /health are scripted, a request's peer, and the refusal a client would get. No process, no
socket: test_query_of_death.py and test_query_of_death_suspects.py share it."""

from gpuwarden.proxy.body import Refusal

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FakeHold:
    """The hold's look at /health, scripted: each look answers the next of `looks` (True: 200; False: refused,
    closed or not 200; None: no answer in time), and the clock moves `step` seconds with it."""

    def __init__(self, looks, clock, step=0.0):
        self.looks, self.clock, self.step, self.planned, self.asked = list(looks), clock, step, False, 0
        self.health = self  # hold.Hold's look.HealthLook: here the script answers both

    async def look(self, since=None):
        self.asked += 1
        self.clock.now += self.step
        return self.looks.pop(0)

    async def engine_down(self, since=None):  # as hold.Hold: no answer in time is down for a request
        return not await self.look(since)


class Peer:
    """What the book reads of a request: its peer's address, its method and path."""

    def __init__(self, remote, path=CHAT):
        self.remote, self.method, self.path = remote, "POST", path


def refusal(book, client):
    """The Refusal the book gives client now, or None."""
    try:
        book.refuse(client)
    except Refusal as exc:
        return exc
    return None
