#!/usr/bin/env bash
# Moved with its study: experiments/gto-draft-opd/scripts/objectives_acceptance.sh
echo "bench/objectives_acceptance.sh moved: run \`experiments/gto-draft-opd/scripts/objectives_acceptance.sh $*\`" >&2
exit 2
