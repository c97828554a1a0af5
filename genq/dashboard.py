"""`python -m genq.dashboard`: rq-dashboard on the run's Redis; its buttons change RQ's lists
behind genq's back, so writes answer 403 unless --allow-write."""

from __future__ import annotations

import argparse
import logging
import os

from genq.common.cli import DEFAULT_REDIS_URL

WRITE_REFUSED = ("rq-dashboard is read-only here: its buttons change RQ's lists behind genq's "
                 "back. Use `genq requeue --redo failed`, or start it with --allow-write.\n")


def build(redis_url: str, allow_write: bool):  # -> flask.Flask (imported lazily: optional)
    from flask import Response, request
    from rq_dashboard.cli import make_flask_app
    from rq_dashboard.web import setup_rq_connection

    app = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = (redis_url,)
    app.config["RQ_DASHBOARD_DISABLE_DELETE"] = not allow_write
    app.config["DEPRECATED_OPTIONS"] = []
    if not allow_write:
        @app.before_request
        def read_only() -> Response | None:
            # /requeue/<queue> answers GET too, so the method alone is not enough.
            if request.method not in ("GET", "HEAD") or request.path.startswith("/requeue/"):
                return Response(WRITE_REFUSED, 403, mimetype="text/plain")
            return None
    setup_rq_connection(app)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m genq.dashboard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                   help="Redis holding the runs (env REDIS_URL)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=9181, help="port to listen on (9181)")
    p.add_argument("--allow-write", action="store_true",
                   default=os.environ.get("GENQ_DASHBOARD_WRITE", "") in ("1", "true", "yes"),
                   help="let the dashboard's buttons change RQ state (env GENQ_DASHBOARD_WRITE)")
    a = p.parse_args(argv)
    try:
        app = build(a.redis_url, a.allow_write)
    except ImportError as e:
        p.error(f"rq-dashboard is not installed ({e}); pip install 'genq[dashboard]'")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    print(f"rq-dashboard on http://{a.host}:{a.port}/ for {a.redis_url} "
          f"({'writes allowed' if a.allow_write else 'read-only'})", flush=True)
    app.run(host=a.host, port=a.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
