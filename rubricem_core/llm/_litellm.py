"""litellm, imported once and quietened: its "Give Feedback / Get Help" banner is printed on every
failed call (80 times in one judge outage) and says nothing our error messages do not."""

from __future__ import annotations

import litellm

litellm.suppress_debug_info = True

__all__ = ["litellm"]
