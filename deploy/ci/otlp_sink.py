"""Stand-in for the OpenTelemetry collector in CI (its images cannot be pulled here): accepts OTLP/HTTP on
:4318 (POST /v1/traces, /v1/metrics, /v1/logs) and answers 200 with an empty protobuf response, logging one
line per export; GET :13133/ answers as the collector's health_check extension does. It proves that llmgw's
processes export to the address docker-compose.yml gives them, not the collector's own pipeline."""

import http.server
import threading


class Otlp(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        size = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(min(size, 64 << 20))
        print(f"otlp export {self.path} {size} bytes", flush=True)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


health = http.server.ThreadingHTTPServer(("0.0.0.0", 13133), Health)
threading.Thread(target=health.serve_forever, daemon=True).start()
http.server.ThreadingHTTPServer(("0.0.0.0", 4318), Otlp).serve_forever()
