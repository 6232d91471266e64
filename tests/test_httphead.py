"""base/httphead.py: the one parser of HTTP/1 heads, for the metrics server's requests and httpget's answers."""

import pytest

from gpuwarden.base import httphead


def test_a_request_head_gives_its_method_target_and_first_headers():
    head = b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization:  Basic one \r\nauthorization: Basic two\r\n\r\n"
    assert httphead.request(head, 1024) == ("GET", "/metrics?x=1", {"host": "a", "authorization": "Basic one"})


@pytest.mark.parametrize("head", [b"NONSENSE\r\n\r\n", b"GET / HTTP/2\r\n\r\n", b"GET  / HTTP/1.1\r\n\r\n",
                                  b"GET / HTTP/1.1\r\nno colon here\r\n\r\n"])
def test_a_request_head_that_is_not_http1_is_refused(head):
    with pytest.raises(httphead.BadHead):
        httphead.request(head, 1024)


def test_a_head_past_its_cap_is_refused_and_one_at_it_is_read():
    head = b"GET / HTTP/1.1\r\nX: " + b"a" * 100
    assert httphead.request(head + b"\r\n\r\n", len(head))[2] == {"x": "a" * 100}  # the blank line is not counted
    with pytest.raises(httphead.BadHead, match=f"larger than {len(head) - 1} bytes"):
        httphead.request(head, len(head) - 1)
    with pytest.raises(httphead.BadHead, match="larger than"):
        httphead.response(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20, 64)


def test_a_response_head_gives_its_code_and_headers():
    assert httphead.response(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3", 1024) == (404, {"content-length": "3"})
    assert httphead.split(b"HTTP/1.1 200 OK\r\n\r\nbody") == (b"HTTP/1.1 200 OK", b"body")
    assert httphead.split(b"HTTP/1.1 200 OK\r\n") is None


@pytest.mark.parametrize("head, why", [(b"SSH-2.0-OpenSSH", "did not answer with HTTP"),
                                       (b"HTTP/1.1 2000 OK", "not three digits"),
                                       (b"HTTP/1.1 " + b"9" * 5000, "not three digits"),
                                       (b"HTTP/1.1 \xb2\xb2\xb2 OK", "not three digits")])
def test_a_response_head_that_is_not_http_is_refused_in_words(head, why):
    with pytest.raises(httphead.BadHead, match=why):
        httphead.response(head, 1 << 16)
