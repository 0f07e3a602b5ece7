"""HttpRolloutClient's transport against a scripted server on loopback: a lost connection and a 503 are sent
again (RetryPolicy), a request's own error never is, and every error answer arrives as the service's typed
error."""

import http.server
import json
import threading

import pytest

from serve_app.errors import (
    HttpStatusError,
    InvalidRequestError,
    OverloadedError,
    PolicyVersionError,
    ReplicaUnavailableError,
    RequestTooLargeError,
    UnauthorizedError,
    WeightsHashMismatchError,
)
from serve_app.http_client import ConnectionLostError, HttpRolloutClient
from serve_app.retry import RetryPolicy

FAST = RetryPolicy(attempts=3, backoff_s=0.0, max_backoff_s=0.0)
VERSIONS = {"latest": 0, "versions": [{"policy_version": 0, "weights_hash": "base", "kind": "base", "tensors": 0,
                                        "bytes": 0}]}


class Script:
    """The answers a server gives, in order: ("close",) drops the connection unanswered, (status, body)
    answers; every request is recorded with its headers."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests = []


@pytest.fixture
def server():
    scripts = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            script = scripts["now"]
            script.requests.append((self.path, dict(self.headers)))
            answer = script.answers.pop(0)
            if answer[0] == "close":
                self.close_connection = True
                self.connection.close()
                return
            status, body = answer
            encoded = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(encoded)))
            self.end_headers()
            self.wfile.write(encoded)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    def start(*answers) -> tuple[Script, str]:
        scripts["now"] = Script(answers)
        return scripts["now"], f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    httpd.shutdown()
    httpd.server_close()


def test_a_lost_connection_and_a_503_are_sent_again(server):
    script, url = server(("close",), (503, {"error": "overloaded", "field": "", "message": "at capacity"}),
                         (200, VERSIONS))
    client = HttpRolloutClient(url, "t0ken", retry=FAST)
    assert client.versions().latest == 0
    assert len(script.requests) == 3 and client.lost_calls == 2
    assert all(headers["Authorization"] == "Bearer t0ken" for _, headers in script.requests)


def test_the_retries_end_with_the_last_failure(server):
    script, url = server(*[("close",)] * 3)
    with pytest.raises(ConnectionLostError):
        HttpRolloutClient(url, retry=FAST).versions()
    assert len(script.requests) == 3


@pytest.mark.parametrize(("status", "body", "error"), [
    (422, {"error": "invalid_request", "field": "sampling.height", "message": "must be a multiple of 16"},
     InvalidRequestError),
    (413, {"error": "invalid_request", "field": "group_size", "message": "too many samples"}, RequestTooLargeError),
    (409, {"error": "PolicyVersionError", "field": "", "message": "policy version 9 does not exist"}, PolicyVersionError),
    (409, {"error": "WeightsHashMismatchError", "field": "", "message": "hash to"}, WeightsHashMismatchError),
    (401, {"error": "UnauthorizedError", "field": "", "message": "needs a token"}, UnauthorizedError),
    (502, {"error": "reward_failed", "field": "", "message": "reward 'x' failed"}, HttpStatusError),
    (500, "Internal Server Error", HttpStatusError),
])
def test_a_request_error_is_typed_and_never_sent_again(server, status, body, error):
    script, url = server((status, body))
    with pytest.raises(error) as raised:
        HttpRolloutClient(url, retry=FAST).versions()
    assert len(script.requests) == 1
    if isinstance(body, dict) and body["field"]:
        assert raised.value.field == body["field"]


def test_a_503_the_retries_do_not_cure_is_raised_typed(server):
    body = {"error": "ReplicaUnavailableError", "field": "", "message": "the replica died 3 times"}
    script, url = server(*[(503, body)] * 3)
    with pytest.raises(ReplicaUnavailableError, match="died 3 times"):
        HttpRolloutClient(url, retry=FAST).versions()
    assert len(script.requests) == 3
    script, url = server((503, {"error": "overloaded", "field": "", "message": "at capacity"}))
    with pytest.raises(OverloadedError):
        HttpRolloutClient(url, retry=RetryPolicy(attempts=1)).versions()


def test_a_keep_alive_connection_closed_while_idle_is_reopened_without_a_retry(server):
    script, url = server((200, VERSIONS), ("close",), (200, VERSIONS))
    client = HttpRolloutClient(url, retry=RetryPolicy(attempts=1))
    client.versions()
    client.versions()  # the server dropped the kept connection: one fresh connection, not a failed attempt
    assert len(script.requests) == 3 and client.lost_calls == 0


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="http"):
        HttpRolloutClient("ftp://example.invalid")
