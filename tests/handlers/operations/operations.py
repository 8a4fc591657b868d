"""Reports, per request, the operation the worker called it for and how the batch was split."""


class Operations:
    def initialize(self, context):
        self.calls = 0

    def handle(self, data, context):
        self.calls += 1
        return [
            {
                "operation": context.operation,
                "explain_header": context.get_request_header(i, "explain"),
                "call": self.calls,
                "batch": len(data),
                "body": row.get("body"),
            }
            for i, row in enumerate(data)
        ]
