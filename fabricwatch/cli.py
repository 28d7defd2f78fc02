"""The `fabricwatch` command line."""
def main() -> None:
    print("fabricwatch")
