"""genq's consumer: one asyncio process that keeps one SGLang server exactly full."""
