"""A load from a second process (tests/security/test_load.py runs it): CLIENTS threads send one
request after another to URL for SECONDS, each on its own keep-alive connection, and it prints
what came back as JSON (statuses, latencies in ms). Standard library and httpx only.

    python load_client.py URL METHOD SECONDS CLIENTS 'HEADER: value' [JSON-BODY]
"""

import json
import sys
import threading
import time

import httpx


def main() -> None:
    url, method, seconds, clients, header = sys.argv[1:6]
    body = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    name, _, value = header.partition(": ")
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + float(seconds)

    def client() -> None:
        with httpx.Client(headers={name: value}, timeout=30) as http:
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    status = str(http.request(method, url, json=body).status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                took = (time.perf_counter() - started) * 1000
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
                    latencies.append(took)

    threads = [threading.Thread(target=client) for _ in range(int(clients))]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"statuses": statuses, "seconds": time.monotonic() - started,
                      "latencies": sorted(latencies)}))  # fmt: skip


if __name__ == "__main__":
    main()
